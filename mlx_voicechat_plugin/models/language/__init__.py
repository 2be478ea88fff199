"""The duplex language model: fused-channel Nemotron-H with text and function heads."""
