"""kvreuse on Ray Serve: replicas that each run one executor, behind the KV-aware router.

::

    client ─▶ Ray HTTP proxy ─▶ KVReuseIngress (one replica)
                                  │ the router app of ``kvreuse route`` (kvreuse.router.app):
                                  │ tenants, limits, retries, mid-stream migration, /v1/route/explain
                                  │ Router.decide: KVIndex overlaps + KVPolicy ─▶ executor = a replica
                                  ▼
                       httpx client ─▶ ReplicaTransport ─▶ DeploymentHandle.call(..., target=replica)
                                                                 │
                                         KVReuseRequestRouter (Ray's RequestRouter, in the ingress process):
                                         sends the call to the replica kvreuse chose; tells the
                                         ReplicaTracker which replicas exist (joins, deaths)
                                                                 ▼
                       KVReuseReplica × N: ``kvreuse serve``'s app and engine (kvreuse.serve_build),
                       called in-process (asgi_call); KV events on a ZMQ PUB socket ─▶ the ingress's index

Modules: ``asgi_call`` (one HTTP request through an ASGI app, streamed), ``replica``,
``transport``, ``request_router`` (with the tracker), ``ingress``, ``app`` (the bound
application, and the builder a ``serve deploy`` config names), ``cli`` (``kvreuse ray``).
``docs/ray.md`` has the design, the deploy config and KubeRay.
"""
