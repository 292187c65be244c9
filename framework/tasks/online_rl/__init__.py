"""Online reinforcement learning on a causal LM: sample completions of prompts, score them, learn from them. The
pieces every algorithm shares, one module each; an algorithm (framework/tasks/grpo.py, framework/tasks/rloo.py) is
a task on them that names its advantages and its policy loss:

- ``task``: the shared task (``OnlineRL``: recipe keys, model, prompts) and its run (``OnlineRun``: reward functions,
  sampling settings, the reference, evaluation by greedy completions);
- ``rollout``: prompts as rows and batches, the keys completions are sampled by, rollouts as micro-batches;
- ``sampling``: completions sampled keyed by example (``generate``);
- ``tools``: the tools and environment a run gives the model (TRL's contract), imported, checked and called;
- ``multi_turn``: rollouts that call tools, token in, token out;
- ``rewards``: reward functions (built-in and the user's, TRL's signature) and scoring completions with them;
- ``advantages``: from rewards to advantages (group-relative, leave-one-out);
- ``policy_loss``: clipped surrogate losses (per token, per sequence) and their normalisers;
- ``step``: the step every algorithm runs (``OnlineStep``): generate, score, advantages, updates.
"""
