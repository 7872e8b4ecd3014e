"""The network service (`serve`) and its client (`listen`): protocol v1 over WebSocket, one stream
of a batched engine per connection (docs/serve.md). The only package that imports the web stack."""
