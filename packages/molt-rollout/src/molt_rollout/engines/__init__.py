"""The engines and how rollouts reach them: vLLM servers, router, token client, lifeline."""
