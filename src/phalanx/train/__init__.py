"""The high-level loop: the Trainer, callbacks, exact evaluation and metrics, lr rules, tracking, progress."""
