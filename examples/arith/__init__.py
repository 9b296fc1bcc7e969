"""The example task: arithmetic with a calculator tool, and the tiny local model that solves it.

The library (`nemo_rl`) never imports this package. A recipe reaches it by configuration:
`env.task: examples.arith.gym_task:TASK` (the default) runs its resources server and prompt
rows, and `model.path: null` with an optional `model.tiny:` block makes the example entry points
build the tiny model (`recipe.load_recipe` + `recipe.resolve_model`). Modules: `task` (problems,
calculator, verifier), `rows` (the Gym `/run` rows and tool output), `resources` (the Gym
resources server process), `gym_task` (`TASK`), `episodes` (an HF `generate` check of a tiny
model), `recipe` (the `model.tiny` block), `tiny_model/` (build, tokenizer, template, SFT).
The long-tail variant (`env.task: examples.arith.gym_task:CHAINED_TASK`, k calculator calls per
prompt): `chain` (chains, tool text, verifier, rows), `chain_resources` (its server), and
`tiny_model/chain_model` (the tiny model fine-tuned on chains, `model.tiny_corpus: arith_chain`).
"""
