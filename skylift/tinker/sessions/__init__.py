"""Sessions and the server's own views: client configuration, health, capabilities, sessions and
heartbeats, the REST views of training runs and their checkpoints, and the sharing figures."""
