"""Runnable entry points (`python -m skylift.entrypoints.main_base key=value ...`)."""
