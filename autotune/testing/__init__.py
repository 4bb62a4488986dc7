"""Test support, kept out of the product's modules (as optuna keeps ``optuna.testing``): a
throwaway PostgreSQL, misbehaving workloads, a colleague's job faked."""
