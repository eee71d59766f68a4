"""esftctl: prepare and serve Expert-Specialized Fine-Tuning (ESFT) adapters of MoE models."""

__version__ = "0.1.0"
