"""A scenario's life on a rank: its shard, its layout, the loss fed back, the training step."""
