"""What runs inside the serving engine (imported as esftctl.runtime)."""
