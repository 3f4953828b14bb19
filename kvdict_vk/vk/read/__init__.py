"""The read wing: reconstructing cached rows on the GPU and reading them back."""
