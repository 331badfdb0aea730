"""`kvmesh operator`: run the kopf operator for InferenceServices."""
from __future__ import annotations

import argparse
import logging
import os

import kopf

from .handlers import OperatorConfig, make_registry


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh operator", description="Reconcile kvmesh InferenceServices.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch this namespace (repeatable; glob patterns allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--standalone", action="store_true",
                   help="skip peering (one operator replica; no KopfPeering objects needed)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--resync-seconds", type=float, default=15.0,
                   help="how often to repair drift, refresh status and autoscale")
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE") or None,
                   help="the operator's own namespace, admitted by each managed Redis' NetworkPolicy "
                        "(default: $POD_NAMESPACE; none: only the service's engines and router)")
    p.add_argument("--watch-secrets", action="store_true",
                   help="watch the Secrets the operator owns (the managed Redis' passwords): a deleted or "
                        "changed one rolls the pods at once instead of at the next resync (needs list and "
                        "watch on Secrets)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        args.all_namespaces = True
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    registry = make_registry(OperatorConfig(resync_seconds=args.resync_seconds,
                                             operator_namespace=args.operator_namespace,
                                             watch_secrets=args.watch_secrets))
    kopf.run(registry=registry, standalone=args.standalone, clusterwide=args.all_namespaces,
             namespaces=args.namespace, liveness_endpoint=args.liveness)
    return 0
