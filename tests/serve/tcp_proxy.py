"""A TCP forwarder in its own process: `python tcp_proxy.py PORT TARGET_HOST TARGET_PORT`.

The failure test puts one in front of a peer and SIGKILLs it: to the manager that is a server dying
mid-run (open connections drop, new ones are refused), while the peer itself lives on for other tests.
"""
import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(port: int, host: str, target_port: int) -> None:
    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
