"""Training of the small shipped GLM-5-architecture model (models/glm-mini); needs torch + transformers."""
