"""Transports: how sparse messages travel between ranks and come back summed."""
