"""The Tinker service's durable records: the typed store (`store`), its database tables and
migrations (`db`), and Tinker paths and the JSON views of stored rows (`views`)."""
