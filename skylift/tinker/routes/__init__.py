"""The Tinker routes as FastAPI routers (``/api/v1`` and ``/skylift``), assembled by
`skylift.tinker.app.create_app`; each takes the service and the caller as dependencies
(`skylift.tinker.deps`) and its body as a typed model (`skylift.tinker.bodies`)."""
