# lmdb_walk against mdb_get, for the differential tests. Included by server_get.pyx.


def search(path, bytes db_name, list keys, unsigned int max_dbs=MAX_DBS):
    """Each key's value in database `db_name` of the LMDB environment at `path`, found the way
    the GET path finds it (lmdb_walk, GROUP keys at a time, mdb_get where it falls back):
    `(values, fallbacks)`, a value being bytes or None. For the differential tests of
    lmdb_walk against mdb_get (tests/test_lmdb_walk.py). Opens and closes an environment of
    its own: not while this process has the same files open in another."""
    cdef MDB_env* env = NULL
    cdef MDB_txn* txn = NULL
    cdef MDB_dbi main, dbi
    cdef MDB_val k, v
    cdef MDB_envinfo info
    cdef MDB_stat st
    cdef WalkMap m
    cdef WalkKey group[GROUP]
    cdef Py_ssize_t i, j, n, start
    cdef size_t root = <size_t>-1
    cdef bint walkable = False
    cdef int rc = mdb_env_create(&env)
    out = []
    fallbacks = 0
    try:
        if rc == 0:
            rc = mdb_env_set_maxdbs(env, max_dbs)
        if rc == 0:
            rc = mdb_env_open(env, os.fsencode(path), MDB_RDONLY | MDB_NOLOCK | MDB_NORDAHEAD, 0o600)
        if rc == 0:
            rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)
        if rc == 0:
            rc = mdb_dbi_open(txn, NULL, 0, &main)
        if rc == 0:
            rc = mdb_dbi_open(txn, PyBytes_AS_STRING(db_name), 0, &dbi)
        if rc != 0:
            raise ReplicaError(mdb_strerror(rc).decode())
        mdb_env_info(env, &info)
        mdb_env_stat(env, &st)
        m.base = NULL
        m.size = info.me_mapsize
        m.last_pgno = info.me_last_pgno
        m.psize = st.ms_psize
        k.mv_size = PyBytes_GET_SIZE(db_name)
        k.mv_data = PyBytes_AS_STRING(db_name)
        if mdb_get(txn, main, &k, &v) == 0 and v.mv_size == 48:
            m.base = walk_map_base(<const unsigned char*>v.mv_data, m.psize)
            if (<const unsigned char*>v.mv_data)[4] == 0 and (<const unsigned char*>v.mv_data)[5] == 0 \
                    and m.base != NULL:
                root = <size_t>_u64le(<const unsigned char*>v.mv_data + 40)
                walkable = True
        for start in range(0, len(keys), GROUP):
            n = min(GROUP, len(keys) - start)
            for j in range(n):
                key = <bytes>keys[start + j]
                group[j].key = <const unsigned char*>PyBytes_AS_STRING(key)
                group[j].klen = PyBytes_GET_SIZE(key)
                group[j].root = root
                if walkable:
                    walk_start(&m, &group[j])
                else:
                    group[j].state = WALK_FALLBACK
            walk_all(&m, group, <int>n)
            for j in range(n):
                if group[j].state == WALK_FALLBACK:
                    fallbacks += 1
                    k.mv_size = group[j].klen
                    k.mv_data = <void*>group[j].key
                    rc = mdb_get(txn, dbi, &k, &v)
                    if rc == 0:
                        out.append(PyBytes_FromStringAndSize(<const char*>v.mv_data, v.mv_size))
                    elif rc == MDB_NOTFOUND:
                        out.append(None)
                    else:
                        raise ReplicaError(mdb_strerror(rc).decode())
                elif group[j].state == WALK_FOUND:
                    out.append(PyBytes_FromStringAndSize(<const char*>group[j].data, group[j].dsize))
                else:
                    out.append(None)
        return out, fallbacks
    finally:
        if txn != NULL:
            mdb_txn_abort(txn)
        mdb_env_close(env)
