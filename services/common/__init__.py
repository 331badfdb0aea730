"""Pieces shared by the engine, the API server and the router."""
