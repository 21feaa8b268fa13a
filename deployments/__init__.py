"""Thin Ray Serve classes around app/: the DAG's stages and the builder that wires them."""
