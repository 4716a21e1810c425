"""The classic scalar Bradley–Terry reward model on the judge's backbone (docs/operations.md, "Scalar reward model")."""
