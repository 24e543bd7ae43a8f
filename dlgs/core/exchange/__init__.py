"""The step and the exchange: SparseExchange and the collaborators it coordinates."""
