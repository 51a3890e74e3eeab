"""What a run leaves on disk: resumable checkpoints (`checkpoint`) and metrics (`metrics`)."""
