"""Pooling models (issue 23): which hidden rows make a sequence's embedding or score (`aserve/config/pooler.py`,
torch-free) and the poolers that compute them over a packed batch (`pooler.py`)."""
