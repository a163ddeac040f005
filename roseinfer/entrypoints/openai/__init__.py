"""The OpenAI-compatible server, one module per concern (vLLM's layout):

api_server.py            build_app: the routes, the middleware, the lifespan
protocol.py              the request bodies (pydantic models: the OpenAPI schema)
errors.py                one error shape, whoever fails
middleware.py            API key, body limit, the checked JSON reader
serving_engine.py        what the generating routes share: checks, admission, streams, SSE
serving_completion.py    /v1/completions
serving_chat.py          /v1/chat/completions
structured_outputs.py    response_format, structured_outputs, guided_*: the request's one constraint
tool_calls.py            tools and tool_choice: checks, forcing schemas, calls out of each choice's text
tool_parsers/            a model's tool-call markup -> OpenAI's tool_calls (--tool-call-parser NAME)
serving_tokenization.py  /tokenize, /detokenize
launcher.py              uvicorn with a draining shutdown
"""
