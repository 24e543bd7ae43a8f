"""Planning: which layers travel together, priced by a cost model and profiled online."""
