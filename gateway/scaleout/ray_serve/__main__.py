"""``python -m prefixgate.gateway.scaleout.ray_serve``: deploy N prefixgate replicas on a Ray
cluster behind Ray Serve's HTTP proxy (docs/fleet.md, "Ray Serve").

    ray start --head                       # or join an existing cluster
    python -m prefixgate.gateway.scaleout.ray_serve --address auto --replicas 2 --port 8000
    curl localhost:8000/v1/chat/completions -d '{"messages": [...]}'
"""

from __future__ import annotations

import argparse
import json
import signal
import threading


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from prefixgate.gateway.scaleout.ray_serve.application import ROUTERS

    parser = argparse.ArgumentParser(prog="python -m prefixgate.gateway.scaleout.ray_serve",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address ('auto' joins the "
                        "local one; none starts a single-node Ray in this process)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=sorted(ROUTERS), default="prefix",
                        help="prefix: ours (block hashes from KV events + load); "
                        "prefix_cache_affinity: Ray Serve LLM's; pow2: Ray's default")
    parser.add_argument("--host", default="127.0.0.1", help="Ray Serve's HTTP proxy host")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="as prefixgate serve --model")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None, help="KV pages per replica")
    parser.add_argument("--kv-memory", type=float, default=None, help="KV GB per replica")
    parser.add_argument("--engine-json", default="{}", help="more EngineConfig fields as JSON")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="Ray num_cpus a replica")
    parser.add_argument("--replica-resources", default="{}", help="Ray custom resources a "
                        "replica asks for, JSON (one per node spreads them over nodes)")
    parser.add_argument("--torch-threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import ray
    from ray import serve

    from prefixgate.gateway.scaleout.ray_serve.application import (
        RayServeOptions,
        build_application,
    )
    from prefixgate.gateway.scaleout.ray_serve.replica import ReplicaOptions

    args = parse_args(argv)
    engine = {"page_size": args.page_size, **json.loads(args.engine_json)}
    for name, value in (("model", args.model), ("num_pages", args.num_pages),
                        ("kv_memory_gb", args.kv_memory)):
        if value is not None:
            engine[name] = value
    options = RayServeOptions(num_replicas=args.replicas, router=args.router,
                              replica=ReplicaOptions(engine=engine,
                                                     torch_threads=args.torch_threads),
                              replica_num_cpus=args.replica_cpus,
                              replica_resources=json.loads(args.replica_resources))
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(options), name="prefixgate", route_prefix="/")
    print(f"prefixgate on Ray Serve: http://{args.host}:{args.port}/v1 "
          f"({args.replicas} replicas, router {args.router})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()


if __name__ == "__main__":
    main()
