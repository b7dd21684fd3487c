"""The TrainingJob API: pydantic models (the single source of truth) and CRD generation."""
