"""Sampling on the device: grammar masks, logit processors, penalties, truncation, draws."""
