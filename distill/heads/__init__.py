"""EAGLE-3-style draft heads: their data (`data`: the target's continuations with its features), their training
(`train`: unrolled on their own outputs), and their line through a recipe (`pipeline`: data, held-out references,
training, the run's result). The decoding side is `decode.head`; what validation reads of a head (its
teacher-forced rounds) is `pairing.head_rounds`."""
