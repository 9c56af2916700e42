"""mini-SWE-agent (PyPI ``mini-swe-agent`` 2.x, unmodified) as a harness on the agent gateway:
``environment.harness.entrypoint=skylift.integrations.mini_swe_agent.harness:run`` and
``environment.harness.verifier=skylift.integrations.mini_swe_agent.harness:verify``."""
