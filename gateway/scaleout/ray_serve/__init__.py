"""N prefixgate replicas as Ray Serve deployments (#40.2; docs/fleet.md, "Ray Serve").

``forwarded`` (the request record the ingress hands a replica), ``block_index`` (which replica
holds which block, from their KV events), ``request_router`` (our prefix-aware Ray Serve
``RequestRouter``), ``replica`` (one prefixgate gateway in a Ray actor), ``ingress`` (the HTTP
front: the three API surfaces, streaming), ``application`` (the options and the wiring),
``__main__`` (``python -m prefixgate.gateway.scaleout.ray_serve``).
"""
