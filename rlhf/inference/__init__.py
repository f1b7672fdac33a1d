"""Generation and scoring over datasets (batch_inference) and the post-processors of the generation pipelines."""
