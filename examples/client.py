"""A client of `specrt serve` through the official openai package, streaming.

specrt serve --bundle engines/demo --port 8000     # in another terminal
python examples/client.py http://127.0.0.1:8000/v1
"""

import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
stream = client.completions.create(model="demo", prompt="def f", max_tokens=32, stream=True)
for chunk in stream:
    print(chunk.choices[0].text, end="", flush=True)
print()
reply = client.chat.completions.create(
    model="demo", messages=[{"role": "user", "content": "Sort a list."}], max_tokens=32
)
print(reply.choices[0].message.content)
