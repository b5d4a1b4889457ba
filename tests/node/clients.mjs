// Node Redis clients against the kvcache sidecar, driven by tests/test_node_clients.py.
// Usage: node clients.mjs <scenario> <unix socket> <key>
// Prints one JSON object per line; a line {"wait": true} means: change <key> through NATS,
// then write a line to stdin to go on. Every wait and poll is bounded.
import { createClient, WatchError } from 'redis';
import Redis from 'ioredis';
import readline from 'node:readline';

const [scenario, path, key] = process.argv.slice(2);
const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const writerTurn = async () => { out({ wait: true }); await lines.next(); };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
// What a transaction with a write in it comes to: its result, or the error it ends in.
const outcome = async (run) => {
  try { return await run(); } catch (e) { return `${e.constructor.name}: ${e.message}`; }
};

async function pollUntil(read, differsFrom, ms = 5000) {
  const t0 = Date.now();
  for (;;) {
    const v = await read();
    if (v !== differsFrom) return { value: v, ms: Date.now() - t0 };
    if (Date.now() - t0 > ms) return { value: v, ms: -1 };
    await sleep(5);
  }
}

async function nodeRedisCache() {
  const client = createClient({ socket: { path }, RESP: 3, clientSideCache: { ttl: 0, maxEntries: 0 } });
  await client.connect();
  const first = await client.get(key);
  for (let i = 0; i < 100; i++) await client.get(key);
  const stats = client.clientSideCache.stats();
  out({ first, hits: stats.hitCount, misses: stats.missCount });
  await writerTurn();
  const seen = await pollUntil(() => client.get(key), first);
  out({ second: seen.value, ms: seen.ms });
  await writerTurn();  // deleted this time
  const gone = await pollUntil(() => client.get(key), seen.value);
  out({ third: gone.value, ms: gone.ms });
  await client.close();
}

async function nodeRedisMulti() {
  const client = createClient({ socket: { path } });
  await client.connect();
  const plain = await client.multi().get(key).ttl(key).strLen(key).exec();
  out({ plain });
  await client.watch(key);
  await writerTurn();
  let watched;
  try {
    watched = await client.multi().get(key).exec();
  } catch (e) {
    watched = e instanceof WatchError ? 'WatchError' : `error: ${e}`;
  }
  out({ watched });
  out({ write: await outcome(() => client.multi().get(key).set(key, 'x').exec()) });
  await client.close();
}

async function ioredisMulti() {
  const client = new Redis({ path, lazyConnect: true, maxRetriesPerRequest: 1 });
  await client.connect();
  const plain = await client.multi().get(key).ttl(key).strlen(key).exec();
  out({ plain });
  await client.watch(key);
  await writerTurn();
  const watched = await client.multi().get(key).exec();
  out({ watched });
  out({ write: await outcome(() => client.multi().get(key).set(key, 'x').exec()) });
  client.disconnect();
}

const scenarios = { 'node-redis-cache': nodeRedisCache, 'node-redis-multi': nodeRedisMulti,
                    'ioredis-multi': ioredisMulti };
const timer = setTimeout(() => { out({ error: 'timed out' }); process.exit(2); }, 60000);
scenarios[scenario]().then(() => { clearTimeout(timer); process.exit(0); },
  (e) => { out({ error: String(e && e.stack || e) }); process.exit(1); });
