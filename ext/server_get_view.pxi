# The replica as the GET path reads it: a read-only LMDB environment of its own on the replica's
# files, a read transaction renewed per call, the map's geometry for lmdb_walk, and each
# bucket's B+tree root and database handle (see the module docstring for why this is sound).
# Included by server_get.pyx; ServerGets derives from it.


cdef class _ReplicaView:
    cdef object replica
    cdef MDB_env* _env
    # one call's state (see ServerGets._start/_finish)
    cdef MDB_txn* _txn     # a call's read transaction: _reader, renewed, or NULL
    cdef MDB_txn* _reader  # kept between calls, reset (no snapshot held) and renewed by each
    cdef size_t _map_txnid # the snapshot _map was read for (0: read it again)
    cdef WalkMap _map
    cdef unsigned long long _txns   # transactions begun: a bucket's root is good for one
    cdef MDB_dbi _main

    def __cinit__(self):
        self._env = NULL
        self._txn = NULL
        self._reader = NULL

    cdef int _open(self, replica, bint writer_here) except -1:
        """`writer_here`: the writer is this process, on this thread (see the module docstring:
        no lock needed). Else (a worker process, kvcache.supervisors.worker) every transaction
        takes a slot in the lock file's reader table like any reader in another process, so
        the writer never reuses a page a snapshot here still reads."""
        self.replica = replica
        path = os.fsencode(replica.path)
        cdef unsigned int flags = MDB_RDONLY | MDB_NORDAHEAD | (MDB_NOLOCK if writer_here else 0)
        cdef int rc = mdb_env_create(&self._env)
        if rc == 0:
            rc = mdb_env_set_maxdbs(self._env, max(MAX_DBS, getattr(replica, "max_dbs", MAX_DBS)))
        if rc == 0:
            rc = mdb_env_open(self._env, path, flags, 0o600)
        if rc != 0:
            raise ReplicaError(f"cannot open the replica for the GET path: {mdb_strerror(rc).decode()}")
        cdef MDB_txn* t = NULL
        self._begin(&t)
        rc = mdb_dbi_open(t, NULL, 0, &self._main)  # the main database: names -> MDB_db records
        mdb_txn_abort(t)
        if rc != 0:
            raise ReplicaError(f"cannot open the replica for the GET path: {mdb_strerror(rc).decode()}")
        return 0

    cdef int _begin(self, MDB_txn** txn) except -1:
        cdef int rc = mdb_txn_begin(self._env, NULL, MDB_RDONLY, txn)
        if rc == MDB_MAP_RESIZED:  # the writer grew the map: adopt its size
            if self._reader != NULL:
                mdb_txn_abort(self._reader)
                self._reader = NULL
            rc = mdb_env_set_mapsize(self._env, 0)
            self._map_txnid = 0
            if rc == 0:
                rc = mdb_txn_begin(self._env, NULL, MDB_RDONLY, txn)
        if rc != 0:
            txn[0] = NULL
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        return 0

    cdef int _read(self) except -1:
        """Open the call's read transaction: _reader renewed (no allocation, as LMDB advises
        for frequent reads), begun anew when there is none or the map was resized. The map's
        geometry and the buckets' roots are read again only when the snapshot has moved."""
        cdef int rc
        cdef MDB_envinfo info
        cdef MDB_stat st
        cdef size_t txnid
        if self._reader != NULL:
            rc = mdb_txn_renew(self._reader)
            if rc != 0:
                mdb_txn_abort(self._reader)
                self._reader = NULL
                if rc != MDB_MAP_RESIZED:
                    raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        if self._reader == NULL:
            self._begin(&self._reader)
        self._txn = self._reader
        txnid = mdb_txn_id(self._txn)
        if txnid != self._map_txnid:
            mdb_env_info(self._env, &info)  # the map and the last page of this snapshot
            mdb_env_stat(self._env, &st)    # (nothing commits while it is open: see above)
            self._map.base = NULL  # found with the first root (walk_map_base)
            self._map.size = info.me_mapsize
            self._map.last_pgno = info.me_last_pgno
            self._map.psize = st.ms_psize
            self._map_txnid = txnid
            self._txns += 1  # every bucket's root is looked up again
        return 0

    cdef void _release(self) noexcept:
        if self._txn != NULL:
            mdb_txn_reset(self._txn)
            self._txn = NULL

    cdef int _find_root(self, _Bucket b) except -1:
        """The bucket's B+tree root in this transaction, from its MDB_db record in the main
        database (48 bytes: md_flags at 4, md_root at 40); a database lmdb_walk does not
        read (flags set, an unexpected record) is left to mdb_get."""
        cdef MDB_val k, v
        cdef int rc
        cdef const unsigned char* rec
        b.root_txn = self._txns
        b.walkable = False
        if not b.has_dbi:  # not created yet: every key is a miss (the fallback says so)
            return 0
        k.mv_size = PyBytes_GET_SIZE(b.db_name)
        k.mv_data = PyBytes_AS_STRING(b.db_name)
        rc = mdb_get(self._txn, self._main, &k, &v)
        if rc == 0 and v.mv_size == 48:
            rec = <const unsigned char*>v.mv_data
            if self._map.base == NULL:
                self._map.base = walk_map_base(rec, self._map.psize)
            if rec[4] == 0 and rec[5] == 0 and self._map.base != NULL:
                b.root = <size_t>_u64le(rec + 40)
                b.walkable = True
        return 0


    cdef int _open_dbi(self, _Bucket b) except -1:
        """Named databases are opened once, in a transaction of their own that is then
        committed: a handle opened in a read transaction lives on only if it commits."""
        cdef MDB_txn* t = NULL
        cdef MDB_dbi dbi
        cdef int rc
        self._begin(&t)
        rc = mdb_dbi_open(t, PyBytes_AS_STRING(b.db_name), 0, &dbi)
        if rc == 0:
            rc = mdb_txn_commit(t)
        else:
            mdb_txn_abort(t)
        if rc == MDB_NOTFOUND:
            return 0  # not created yet by the writer: every key is a miss for now
        if rc != 0:
            raise ReplicaError(f"replica read failed: {mdb_strerror(rc).decode()}")
        b.dbi = dbi
        b.has_dbi = True
        return 0

