"""What is trained: the code types, the shapes (SAE, transcoder, skip, cross-layer), the sparse kernels."""
