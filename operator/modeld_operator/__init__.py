"""modeld's Kubernetes operator: Cells and Sessions (modeld.contenox.io/v1alpha1)."""

__version__ = "0.1.0"
