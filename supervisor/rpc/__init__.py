"""Models split over several machines with llama.cpp's RPC backend."""
