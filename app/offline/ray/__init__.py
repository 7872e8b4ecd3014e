"""Offline work on Ray: the cluster session, and Ray Data jobs for `extract` and `accuracy`."""
