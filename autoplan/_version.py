"""autoplan's version, in a module of its own so that any layer can read it without importing the
package's public API (`autoplan/__init__.py` sits above every layer: docs/architecture.md)."""

__version__ = "0.1.0"
