"""Offline jobs over the runtime: `batch.run_batch` behind `specrt batch`."""
