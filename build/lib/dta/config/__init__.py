"""Configuration of a run: the OmegaConf schema (``schema``) and the keys ``dta train`` reads
(``keys``)."""
