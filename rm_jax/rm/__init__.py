"""The classic scalar Bradley–Terry reward model on the judge's backbone (README, "Scalar reward model")."""
