"""What every Tinker feature shares: errors, auth (who is calling), request limits, fair shares,
futures and ordered queues, ownership checks, the JSON and protobuf bodies' common parts, the
FastAPI dependencies the routers take and the HTTP plumbing of the app."""
