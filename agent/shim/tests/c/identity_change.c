/* A registered program that changes who it is: opens the first device (so that its shim
 * registers), prints "ready", waits for a line on stdin, then
 *   setuid UID  drops to UID (setgroups, setresgid, setresuid: all of real, effective and
 *               saved), prints "dropped", and holds the device for up to 60 s;
 *   thread-setuid UID
 *               a new thread drops to UID with raw system calls (setresgid, setresuid:
 *               only that thread changes, glibc's wrappers would change every thread),
 *               prints "dropped", and holds the device for up to 60 s;
 *   orphan      forks a child that keeps every descriptor (the shim's registration socket
 *               among them) and sleeps up to 60 s, prints "child PID", and exits.
 * Usage: identity_change setuid UID | identity_change thread-setuid UID |
 *        identity_change orphan */
#define _GNU_SOURCE
#include <grp.h>
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int fail(const char *m) { fprintf(stderr, "identity_change: %s\n", m); return 2; }

static uid_t thread_uid;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int thread_result = -1;

static void *drop_in_thread(void *arg) {
	(void)arg;
	uid_t id = thread_uid;
	int rc = syscall(SYS_setresgid, id, id, id) || syscall(SYS_setresuid, id, id, id);
	pthread_mutex_lock(&lock);
	thread_result = rc;
	pthread_cond_signal(&changed);
	pthread_mutex_unlock(&lock);
	sleep(60);
	return NULL;
}

int main(int argc, char **argv) {
	if (argc < 2) return fail("usage: identity_change setuid UID | thread-setuid UID | orphan");
	struct ibv_device **devs = ibv_get_device_list(NULL);
	if (!devs || !devs[0]) return fail("no device");
	struct ibv_context *ctx = ibv_open_device(devs[0]);
	if (!ctx) return fail("ibv_open_device");
	printf("ready\n");
	fflush(stdout);
	char line[64];
	if (!fgets(line, sizeof line, stdin)) return fail("no go on stdin");
	if (strcmp(argv[1], "setuid") == 0 && argc == 3) {
		uid_t id = (uid_t)strtoul(argv[2], NULL, 10);
		if (setgroups(0, NULL) || setresgid(id, id, id) || setresuid(id, id, id))
			return fail("cannot change identity (needs root)");
		printf("dropped\n");
		fflush(stdout);
		sleep(60);
		return 0;
	}
	if (strcmp(argv[1], "thread-setuid") == 0 && argc == 3) {
		thread_uid = (uid_t)strtoul(argv[2], NULL, 10);
		pthread_t t;
		if (pthread_create(&t, NULL, drop_in_thread, NULL)) return fail("pthread_create");
		pthread_mutex_lock(&lock);
		while (thread_result < 0) pthread_cond_wait(&changed, &lock);
		pthread_mutex_unlock(&lock);
		if (thread_result) return fail("cannot change the thread's identity (needs root)");
		if (geteuid() != 0) return fail("the main thread changed too");
		printf("dropped\n");
		fflush(stdout);
		pthread_join(t, NULL);
		return 0;
	}
	if (strcmp(argv[1], "orphan") == 0) {
		pid_t child = fork();
		if (child < 0) return fail("fork");
		if (child == 0) {
			sleep(60);
			_exit(0);
		}
		printf("child %d\n", (int)child);
		fflush(stdout);
		_exit(0);
	}
	return fail("usage: identity_change setuid UID | thread-setuid UID | orphan");
}
