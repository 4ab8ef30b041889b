/* The table pointer behind reduce_kernels_import.h: one per extension that imports the kernels. */
#include "reduce_kernels_import.h"

const struct coll_kernel_api *coll_kernels = NULL;

int coll_kernels_set(const void *api)
{
    const struct coll_kernel_api *t = api;
    if (t == NULL || t->version != COLL_KERNEL_API_VERSION || t->size < sizeof(struct coll_kernel_api))
        return -1;
    coll_kernels = t;
    return 0;
}
