"""A deliberately broken passkit plugin (see README.md)."""
