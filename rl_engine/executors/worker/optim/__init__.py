"""The optimizers DeepSpeed steps: blockwise torch AdamW, and the layout-free update's AdamW."""
