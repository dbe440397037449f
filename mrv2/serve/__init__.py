"""The online path: ``AsyncLLM`` (async_engine.py) and an OpenAI-compatible server.

``python -m mrv2 serve [MODEL]`` runs ``api_server.py`` (FastAPI + uvicorn, the ``serve``
extra); ``protocol.py`` holds the request models; ``cli.py`` the flags (light: ``--help``
imports neither FastAPI nor torch). See notebooks/12_serving.ipynb.
"""
