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

// A bucket's stream `@<bucket>` (<key> is the bucket here) through each library's own stream
// API: rows are [revision, key, op, value or null].
const nodeRows = (messages) => messages.map(({ id, message }) =>
  [Number(id.split('-')[0]), message.key, message.op, message.value ?? null]);
const ioRows = (entries) => entries.map(([id, flat]) => {
  const f = {};
  for (let i = 0; i < flat.length; i += 2) f[flat[i]] = flat[i + 1];
  return [Number(id.split('-')[0]), f.key, f.op, f.value ?? null];
});

async function nodeRedisStream() {
  const stream = `@${key}`;
  const client = createClient({ socket: { path } });
  await client.connect();
  const listing = nodeRows(await client.xRange(stream, '-', '+'));
  const [{ name, messages }] = await client.xRead({ key: stream, id: '0' });
  out({ listing, name, read: nodeRows(messages) });
  const mid = listing[Math.floor(listing.length / 2)][0];
  const resumed = await client.xRead({ key: stream, id: `${mid}-0` });
  out({ mid, resumed: resumed ? nodeRows(resumed[0].messages) : [] });
  const blocking = client.duplicate();  // node-redis: a blocking read needs its own connection
  await blocking.connect();
  for (const turn of ['put', 'delete']) {
    const last = listing.length ? `${listing[listing.length - 1][0]}-0` : '0';
    const pending = blocking.xRead({ key: stream, id: '$' }, { BLOCK: 20000 });
    await sleep(200);  // the read is blocked on the sidecar before the writer's turn
    await writerTurn();
    const got = await pending;
    out({ turn, live: got ? nodeRows(got[0].messages) : null, last });
  }
  await blocking.close();
  await client.close();
}

async function ioredisStream() {
  const stream = `@${key}`;
  const client = new Redis({ path, lazyConnect: true, maxRetriesPerRequest: 1 });
  await client.connect();
  const listing = ioRows(await client.xrange(stream, '-', '+'));
  const [[name, entries]] = await client.xread('STREAMS', stream, '0');
  out({ listing, name, read: ioRows(entries) });
  const mid = listing[Math.floor(listing.length / 2)][0];
  const resumed = await client.xread('STREAMS', stream, `${mid}-0`);
  out({ mid, resumed: resumed ? ioRows(resumed[0][1]) : [] });
  const blocking = new Redis({ path, lazyConnect: true, maxRetriesPerRequest: 1 });
  await blocking.connect();
  for (const turn of ['put', 'delete']) {
    const pending = blocking.xread('BLOCK', 20000, 'STREAMS', stream, '$');
    await sleep(200);
    await writerTurn();
    const got = await pending;
    out({ turn, live: got ? ioRows(got[0][1]) : null });
  }
  blocking.disconnect();
  client.disconnect();
}

const scenarios = { 'node-redis-cache': nodeRedisCache, 'node-redis-multi': nodeRedisMulti,
                    'ioredis-multi': ioredisMulti, 'node-redis-stream': nodeRedisStream,
                    'ioredis-stream': ioredisStream };
const timer = setTimeout(() => { out({ error: 'timed out' }); process.exit(2); }, 60000);
scenarios[scenario]().then(() => { clearTimeout(timer); process.exit(0); },
  (e) => { out({ error: String(e && e.stack || e) }); process.exit(1); });
