"""The scheduler and its one output, the data contract with the model runner."""
