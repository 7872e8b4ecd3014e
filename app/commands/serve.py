"""`python main.py serve`: classify live audio from WebSocket clients, one stream of one batched
engine per connection (docs/serve.md); with ``--ray``, K replicas on Ray Serve."""
from __future__ import annotations

from app.serve.protocol import Limits
from models.variants import VARIANTS

from . import command
from .argtypes import POSITIVE, SECONDS, WINDOW, add_device_arguments, compute_device, integer, number


def add_arguments(p) -> None:
    from app.runtime.frontend_args import add_frontend_arguments
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback only with --token-file)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (0: any free one, printed)")
    p.add_argument("--token-file", metavar="FILE",
                   help="clients must give the token in FILE ('Authorization: Bearer TOKEN'; the page: /#token=TOKEN)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages of ORIGIN (scheme://host[:port]) use the server beside its own page; repeat for more")
    p.add_argument("--ssl-certfile", metavar="FILE", help="serve https and wss with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--max-streams", type=POSITIVE, default=32, help="clients at once (one stream each)")
    p.add_argument("--batch-delay-ms", type=number(0, 1000), default=None, metavar="MS",
                   help="a ready hop waits at most this for the other streams of its lane, to step them "
                        "together (default 40; 0: at once)")
    add_device_arguments(p)
    add_frontend_arguments(p)
    p.add_argument("--variant", action="append", choices=VARIANTS, metavar="VARIANT",
                   help=f"add an untrained model of VARIANT ({', '.join(VARIANTS)}); repeat for more "
                        "(default: none when trained models exist, else all)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="FILE",
                   help="run this trained model instead of the shipped ones; repeat for more")
    p.add_argument("--onnx", action="append", default=[], metavar="FILE", help="refused: an exported step runs one stream")
    p.add_argument("--layers", type=int, choices=(1, 2), default=1, help="blocks of untrained models")
    p.add_argument("--window", type=WINDOW, default=None, help="window n of untrained models in tokens")
    p.add_argument("--landmarks", type=POSITIVE, default=4, help="Nyström landmarks m of untrained models")
    p.add_argument("--seed", type=int, default=0, help="seed of the (untrained) model weights")
    p.add_argument("--processes", type=POSITIVE, default=1,
                   help="CPU: K engine processes of one lane each behind one socket, the streams spread over "
                        "them (default: 1, one process with a lane per core)")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="deploy on Ray Serve: a local Ray instance, or join the cluster at ADDRESS (auto, HOST:PORT)")
    p.add_argument("--replicas", type=POSITIVE, default=1, help="with --ray: replicas, each one batched engine")
    lim = p.add_argument_group("limits per client (docs/serve.md)")
    lim.add_argument("--max-streams-per-address", type=integer(0), default=None, metavar="N",
                     help="WebSocket connections of one client address at once (default: a quarter of "
                          "--max-streams, at least 1; 0: no cap)")
    lim.add_argument("--client-speed", type=number(above=0), default=Limits.speed, metavar="X",
                     help="read a client's audio at most X times real time after a first 5 s")
    lim.add_argument("--max-lag-seconds", type=SECONDS, default=Limits.lag_seconds, metavar="S",
                     help="close a stream whose audio falls more than S behind real time (after its first 10 s)")
    lim.add_argument("--request-seconds", type=SECONDS, default=Limits.request_seconds, metavar="S",
                     help="close a connection whose HTTP request (the WebSocket upgrade) is not whole within S")
    lim.add_argument("--max-upload-mb", type=number(above=0), default=Limits.upload_bytes / 2**20, metavar="MB",
                     help="refuse a POSTed file over MB mebibytes (413; by its Content-Length, before reading it)")
    lim.add_argument("--ping-seconds", type=SECONDS, default=Limits.ping_seconds, metavar="S",
                     help="keepalive: ping a client every S, close it when no pong comes within S")


def hub_spec(args):
    from app.runtime.frontend_args import FrontEndSpec, frontend_name, random_seed
    from app.serve.spec import HubSpec
    fe = FrontEndSpec(frontend_name(args), args.vggish_weights, random_seed(args), True, args.device,
                      precision=args.precision)
    shape = {"layers": args.layers, "window": args.window, "landmarks": args.landmarks, "seed": args.seed}
    delay = {} if args.batch_delay_ms is None else {"batch_delay_ms": args.batch_delay_ms}
    per_address = args.max_streams_per_address
    limits = Limits(speed=args.client_speed, lag_seconds=args.max_lag_seconds, request_seconds=args.request_seconds,
                    ping_seconds=args.ping_seconds, upload_bytes=int(args.max_upload_mb * 2**20),
                    streams_per_address=max(1, args.max_streams // 4) if per_address is None else per_address)
    return HubSpec(fe, args.max_streams, tuple(args.checkpoint),
                   tuple(args.variant) if args.variant else None, shape, limits, **delay)


@command("serve", add_arguments)
def run(args) -> int:
    from app.serve.server import ServeError, check_exposure, public_options, read_token
    if args.onnx:
        raise SystemExit("serve: --onnx is refused: an exported step holds one stream's state; "
                         "serve batches torch models (--checkpoint)")
    try:
        token = read_token(args.token_file) if args.token_file else None
        check_exposure(args.host, token)
        public = public_options(args.host, args.allow_origin, args.ssl_certfile, args.ssl_keyfile)
    except ServeError as e:
        raise SystemExit(f"serve: {e}") from None
    if args.processes > 1 and (args.ray or args.device != "cpu"):
        raise SystemExit("serve: --processes is for the plain server on the CPU "
                         "(with --ray: --replicas; on CUDA one process holds the device)")
    compute_device(args, "serve")
    if args.processes > 1:
        from app.serve.workers import serve_workers
        return serve_workers(hub_spec(args), token, args.host, args.port, args.processes, public)
    if args.ray:
        from app.serve.ray_serve import deploy
        return deploy(hub_spec(args), token, args.host, args.port, args.replicas, args.ray, public)
    from app.serve.server import serve_forever
    return serve_forever(hub_spec(args), token, args.host, args.port, public)
