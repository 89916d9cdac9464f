"""The engines and how rollouts reach them: vLLM servers and their command line, the router,
the token client, the assembled service, the lifeline, the tiny test models."""
