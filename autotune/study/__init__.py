"""What a study stores, and how it is opened: the one place that knows an autotune study's shape
in its Optuna storage."""
